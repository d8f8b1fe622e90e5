//! One endpoint's live state inside a rule: health verdict, in-flight estimate, subscriber state
//! per rank, parity verdict, scraped capacity, sequence positions and replication ownership.
//!
//! Every field is private: the health task, the ingest feeds and replication change it through
//! the methods below, each of which keeps one fact consistent (a sequence per rank, a bounded
//! decision queue, a dirty flag cleared only by the snapshot that covers it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus::IntGauge;
use serde::Serialize;

use kvroute_core::wire::EndpointOutcomes;

use super::canary::CanaryVerdict;
use super::outcomes::{diverges, OutcomeWindow};
use crate::index::Rank;
use crate::settings::Divergence;
use crate::sync::lock;

/// What the self-check concluded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ParityReport {
    pub message: String,
    pub suggested_algo: Option<String>,
    pub suggested_seed: Option<String>,
    pub suggested_block_size: Option<u32>,
}

/// Where an endpoint's parity self-check stands, for `/healthz`: a check that passed and one that
/// never ran must not look alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ParityStatus {
    /// No BlockStored with token ids has been checked yet (events not flowing, `kvKeyMode` tokens,
    /// TensorRT-LLM, or the engine does not publish token ids).
    Unchecked,
    /// The latest checked key matched the rule's contract.
    Match,
    /// The latest checked key did not match: see the report.
    Mismatch,
}

/// Parity self-check totals of one endpoint (all ranks).
#[derive(Clone, Debug, Default)]
struct Parity {
    matched: u64,
    mismatched: u64,
    /// The latest mismatch's report; cleared by a later match.
    report: Option<ParityReport>,
}

/// "No sequence seen" in [`EpRuntime`]'s per-rank sequences.
const NO_SEQ: u64 = u64::MAX;

/// Routing decisions kept for the in-flight estimate; past this the estimate is "very loaded"
/// either way.
const MAX_DECISIONS: usize = 100_000;

/// One endpoint's live state.
pub struct EpRuntime {
    /// Health-check verdict; starts healthy so a rule routes before the first check.
    healthy: AtomicBool,
    /// Routing decisions not yet covered by a metrics scrape.
    decisions: Mutex<VecDeque<Instant>>,
    /// Last scrape: (when, running + waiting).
    scraped: Mutex<Option<(Instant, u64)>>,
    /// Per rank: subscriber/poller connected.
    connected: Vec<AtomicBool>,
    /// Parity self-check totals and the latest mismatch (any rank).
    parity: Mutex<Parity>,
    /// Cache capacity in blocks scraped from the engine (`num_gpu_blocks`); 0 = not scraped.
    capacity: AtomicU64,
    /// Per rank: the last publisher sequence applied ([`NO_SEQ`] = none), from ingestion or the
    /// replication log; a replica taking the endpoint over resumes from it.
    seqs: Vec<AtomicU64>,
    /// This replica ingests the endpoint's events (always, standalone; the lease holder, replicated).
    owned: AtomicBool,
    /// Replicated: the endpoint's snapshot must be rewritten (takeover, writes lost to an outage).
    dirty: AtomicBool,
    /// Replicated: when this replica last wrote the endpoint's snapshot.
    snapshot_at: Mutex<Option<Instant>>,
    /// The filters' predicted-against-realised reports within the divergence window.
    outcomes: Mutex<OutcomeWindow>,
    /// The divergence verdict as of the last report or read ([`EpRuntime::outcomes`]); routing
    /// reads only this flag, so a decision takes no lock for it.
    divergent: AtomicBool,
    /// The endpoint's `kvroute_index_blocks` series, looked up once: ingestion sets it after
    /// every message.
    pub(super) blocks_gauge: OnceLock<IntGauge>,
    /// `kvroute_index_lower_blocks{rule,ep,medium}` per [`crate::index::Lower`] tier, looked up once.
    pub(super) lower_gauges: OnceLock<[IntGauge; 2]>,
    /// The parity canary's latest verdict (none before its first run, or with the canary off).
    canary: Mutex<Option<CanaryVerdict>>,
}

impl EpRuntime {
    pub(super) fn new(ranks: usize) -> EpRuntime {
        EpRuntime {
            healthy: AtomicBool::new(true),
            decisions: Mutex::new(VecDeque::new()),
            scraped: Mutex::new(None),
            connected: (0..ranks.max(1)).map(|_| AtomicBool::new(false)).collect(),
            parity: Mutex::new(Parity::default()),
            capacity: AtomicU64::new(0),
            seqs: (0..ranks.max(1)).map(|_| AtomicU64::new(NO_SEQ)).collect(),
            owned: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            snapshot_at: Mutex::new(None),
            outcomes: Mutex::default(),
            divergent: AtomicBool::new(false),
            blocks_gauge: OnceLock::new(),
            lower_gauges: OnceLock::new(),
            canary: Mutex::new(None),
        }
    }

    /// The parity canary's latest verdict.
    pub fn canary(&self) -> Option<CanaryVerdict> {
        lock(&self.canary).clone()
    }

    pub fn set_canary(&self, v: CanaryVerdict) {
        *lock(&self.canary) = Some(v);
    }

    /// Adds a filter's outcome report received at `now`; returns the divergence verdict before
    /// and after it, and the window's sum it was judged on.
    pub fn record_outcomes(
        &self,
        o: &EndpointOutcomes,
        now: Instant,
        d: &Divergence,
    ) -> (bool, bool, EndpointOutcomes) {
        let sum = {
            let mut w = lock(&self.outcomes);
            w.add(now, o, d.window);
            w.sum(now, d.window)
        };
        let after = diverges(&sum, d.min_requests);
        (self.divergent.swap(after, Ordering::Relaxed), after, sum)
    }

    /// The reports within the window of `now` and their verdict (which the flag routing reads
    /// then follows, so a verdict also clears once its reports leave the window).
    pub fn outcomes(&self, now: Instant, d: &Divergence) -> (EndpointOutcomes, bool) {
        let sum = lock(&self.outcomes).sum(now, d.window);
        let verdict = diverges(&sum, d.min_requests);
        self.divergent.store(verdict, Ordering::Relaxed);
        (sum, verdict)
    }

    /// The last divergence verdict.
    pub fn divergent(&self) -> bool {
        self.divergent.load(Ordering::Relaxed)
    }

    /// Takes over what a replaced rule knew of the same engine: sequences, health, capacity.
    pub(super) fn inherit(&self, old: &EpRuntime) {
        for (src, dst) in old.seqs.iter().zip(&self.seqs) {
            dst.store(src.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.set_healthy(old.healthy());
        self.set_capacity(old.capacity());
    }

    /// The health verdict the scorer obeys.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Sets the health verdict; returns the previous one.
    pub fn set_healthy(&self, up: bool) -> bool {
        self.healthy.swap(up, Ordering::Relaxed)
    }

    /// Per rank: whether its subscriber (or drain poller) is connected.
    pub fn connected(&self) -> Vec<bool> {
        self.connected
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    pub(super) fn set_connected(&self, rank: Rank, up: bool) {
        if let Some(c) = self.connected.get(usize::from(rank.0)) {
            c.store(up, Ordering::Relaxed);
        }
    }

    /// The latest parity mismatch, if the last checked key did not match.
    pub fn parity(&self) -> Option<ParityReport> {
        lock(&self.parity).report.clone()
    }

    /// The self-check's standing and its totals `(matched, mismatched)`.
    pub fn parity_status(&self) -> (ParityStatus, u64, u64) {
        let p = lock(&self.parity);
        let status = match (&p.report, p.matched + p.mismatched) {
            (_, 0) => ParityStatus::Unchecked,
            (Some(_), _) => ParityStatus::Mismatch,
            (None, _) => ParityStatus::Match,
        };
        (status, p.matched, p.mismatched)
    }

    /// Adds checks run since the last call; `report` is the publisher's latest verdict (`None`:
    /// its last checked key matched).
    pub fn record_parity(&self, matched: u64, mismatched: u64, report: Option<ParityReport>) {
        let mut p = lock(&self.parity);
        p.matched += matched;
        p.mismatched += mismatched;
        p.report = report;
    }

    /// The engine's scraped `num_gpu_blocks`; 0 = not scraped.
    pub fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Records the engine's scraped `num_gpu_blocks`.
    pub fn set_capacity(&self, blocks: u64) {
        self.capacity.store(blocks, Ordering::Relaxed);
    }

    /// Records the sequence of the message about to be applied for `rank`.
    pub fn note_seq(&self, rank: Rank, seq: u64) {
        if let Some(s) = self.seqs.get(usize::from(rank.0)) {
            s.store(seq, Ordering::Relaxed);
        }
    }

    /// The last sequence applied for `rank`, if any.
    pub fn last_seq(&self, rank: Rank) -> Option<u64> {
        self.seqs
            .get(usize::from(rank.0))
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|s| *s != NO_SEQ)
    }

    /// Whether this replica ingests the endpoint's events.
    pub fn owned(&self) -> bool {
        self.owned.load(Ordering::Relaxed)
    }

    /// Marks the endpoint ingested here (`true`) or elsewhere (`false`).
    pub fn set_owned(&self, owned: bool) {
        self.owned.store(owned, Ordering::Relaxed);
    }

    /// Replicated: the next snapshot must be written (a takeover, or writes that were lost).
    pub fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Whether a snapshot is owed.
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Clears the dirty flag for the snapshot about to be taken; returns whether it was set. A
    /// change racing with the snapshot marks it dirty again.
    pub fn take_dirty(&self) -> bool {
        self.dirty.swap(false, Ordering::Relaxed)
    }

    /// When this replica last wrote the endpoint's snapshot.
    pub fn snapshot_at(&self) -> Option<Instant> {
        *lock(&self.snapshot_at)
    }

    /// Records a written snapshot.
    pub fn snapshot_written(&self, at: Instant) {
        *lock(&self.snapshot_at) = Some(at);
    }

    /// Records a routing decision to this endpoint.
    pub fn record_decision(&self, now: Instant) {
        let mut d = lock(&self.decisions);
        d.push_back(now);
        if d.len() > MAX_DECISIONS {
            d.pop_front();
        }
    }

    /// Records a metrics scrape (running + waiting requests).
    pub fn record_scrape(&self, now: Instant, load: u64) {
        *lock(&self.scraped) = Some((now, load));
    }

    /// In-flight estimate: the last scrape plus decisions since, or decisions within `window`.
    pub fn load(&self, now: Instant, window: Duration, scrape_fresh: Duration) -> u64 {
        let scraped = *lock(&self.scraped);
        let mut d = lock(&self.decisions);
        while d
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > window)
        {
            d.pop_front();
        }
        match scraped {
            Some((t, v)) if now.saturating_duration_since(t) <= scrape_fresh => {
                v + d.iter().filter(|x| **x > t).count() as u64
            }
            _ => d.len() as u64,
        }
    }
}
