//! The parity canary's tap on an endpoint's ingestion: while a canary run listens, each
//! `BlockStored` with token ids that starts a chain or continues one of the run's prompts is copied
//! for it (at most [`MAX_TAPPED`]); otherwise a tap costs one relaxed atomic load per stored event.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

use super::decode::Stored;
use crate::sync::lock;

/// Stored events one run keeps at most (other traffic's chain starts included).
pub const MAX_TAPPED: usize = 1024;

/// What an endpoint's ingestion hands a listening run.
#[derive(Debug, Default)]
pub struct Tap {
    armed: AtomicBool,
    inner: Mutex<Tapped>,
    /// Notified for every event kept.
    pub arrived: Notify,
}

#[derive(Debug, Default)]
struct Tapped {
    /// Every key of the run's prompts: a continuation whose parent is one of them is the run's.
    expected: HashSet<u64>,
    events: Vec<Stored>,
}

impl Tap {
    /// Whether a run listens: one relaxed load, for ingestion that must build the event it
    /// would offer (TensorRT-LLM's JSON) only when someone takes it.
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// Called by ingestion for every `BlockStored`: keeps a copy while a run listens.
    pub fn offer(&self, s: &Stored) {
        if !self.armed.load(Ordering::Relaxed) || s.token_ids.is_empty() {
            return;
        }
        let mut t = lock(&self.inner);
        let ours = s.parent.is_none_or(|p| t.expected.contains(&p));
        if !ours || t.events.len() >= MAX_TAPPED {
            return;
        }
        t.events.push(s.clone());
        drop(t);
        self.arrived.notify_one();
    }

    /// Starts keeping the events of a run whose prompts have the keys `expected`; the run
    /// listens until the returned guard drops.
    pub fn arm(&self, expected: HashSet<u64>) -> Armed<'_> {
        *lock(&self.inner) = Tapped {
            expected,
            events: Vec::new(),
        };
        self.armed.store(true, Ordering::Release);
        Armed(self)
    }

    /// The events kept so far, in arrival order.
    pub fn events(&self) -> Vec<Stored> {
        lock(&self.inner).events.clone()
    }
}

/// Listening; dropping it stops the tap and frees what it kept.
pub struct Armed<'a>(&'a Tap);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.armed.store(false, Ordering::Release);
        *lock(&self.0.inner) = Tapped::default();
    }
}
