//! Deterministic workloads: sessions of chat turns with arrival times.
//!
//! Every workload is a list of [`Session`]s. A session belongs to a tenant, shares a long prefix
//! with the other sessions of its `group` (a system prompt, a document), and sends its turns one
//! after another, each turn extending the conversation with the previous answer. Text is made of
//! pseudo-random words from a seeded generator, so a run is reproducible.

use std::sync::Arc;
use std::time::Duration;

/// The workload shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Users x turns sharing K system prompts.
    MultiTurn,
    /// Many questions per long document.
    DocQa,
    /// Unique prompts: affinity must not hurt.
    OneShot,
    /// Most traffic on one hot prefix: spill relief.
    HotPrefix,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 4] = [Kind::MultiTurn, Kind::DocQa, Kind::OneShot, Kind::HotPrefix];

    /// Command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::MultiTurn => "multi-turn",
            Kind::DocQa => "doc-qa",
            Kind::OneShot => "one-shot",
            Kind::HotPrefix => "hot-prefix",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// How sessions arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Everything at t=0 (bounded by the driver's concurrency).
    Burst,
    /// Session starts spread evenly over the ramp.
    Staggered,
}

/// Sizes of one run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Shape {
    /// Multi-turn: users.
    pub users: usize,
    /// Multi-turn: turns per user.
    pub turns: usize,
    /// Shared prefixes (system prompts, documents).
    pub groups: usize,
    /// Words per shared prefix.
    pub prefix_words: usize,
    /// Words per user message.
    pub message_words: usize,
    /// Doc-QA: questions per document.
    pub questions: usize,
    /// One-shot and hot-prefix: requests.
    pub requests: usize,
    /// Hot-prefix: share of requests on the hot prefix.
    pub hot_share: f64,
    /// Output tokens per request.
    pub max_tokens: usize,
    /// Arrival pattern.
    pub arrival: Arrival,
    /// Staggered arrival: sessions start over this span.
    pub ramp: Duration,
}

/// One user's conversation.
#[derive(Clone, Debug)]
pub struct Session {
    /// Tenant (the `user` field; what tenant-sticky hashing uses).
    pub tenant: String,
    /// Which shared prefix.
    pub group: usize,
    /// The shared prefix (system message).
    pub system: Arc<String>,
    /// User messages, sent in order.
    pub turns: Vec<String>,
    /// When the session starts, from the run's start.
    pub start: Duration,
}

/// splitmix64: a tiny seeded generator (no dependency, identical everywhere).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const SYLLABLES: &[&str] = &[
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "so", "da", "fu", "gi", "ha", "ju", "ke",
    "ly", "mo", "nu", "po", "ri", "se", "tu", "va", "we", "xo", "yu", "ze", "bra", "cli", "dro",
    "fla", "gre", "pla", "sto", "tri",
];

/// `n` pseudo-random words.
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        for _ in 0..2 + rng.below(2) {
            s.push_str(SYLLABLES[rng.below(SYLLABLES.len())]);
        }
    }
    s
}

/// Builds the sessions of one workload.
pub fn generate(kind: Kind, shape: &Shape, seed: u64) -> Vec<Session> {
    let mut rng = Rng::new(seed ^ (kind as u64).wrapping_mul(0x1000_0000_01b3));
    let groups: Vec<Arc<String>> = (0..shape.groups.max(1))
        .map(|g| {
            let body = words(&mut rng, shape.prefix_words);
            Arc::new(match kind {
                Kind::DocQa => format!("Answer questions about document {g}. Document: {body}"),
                _ => format!("You are assistant persona {g}. {body}"),
            })
        })
        .collect();
    let mut sessions = Vec::new();
    match kind {
        Kind::MultiTurn => {
            for u in 0..shape.users {
                let turns = (0..shape.turns)
                    .map(|_| words(&mut rng, shape.message_words))
                    .collect();
                sessions.push(Session {
                    tenant: format!("user-{u}"),
                    group: u % groups.len(),
                    system: groups[u % groups.len()].clone(),
                    turns,
                    start: Duration::ZERO,
                });
            }
        }
        Kind::DocQa => {
            for q in 0..shape.questions {
                for (g, doc) in groups.iter().enumerate() {
                    sessions.push(Session {
                        tenant: format!("reader-{g}-{q}"),
                        group: g,
                        system: doc.clone(),
                        turns: vec![format!(
                            "Question {q}: {}",
                            words(&mut rng, shape.message_words)
                        )],
                        start: Duration::ZERO,
                    });
                }
            }
        }
        Kind::OneShot => {
            for i in 0..shape.requests {
                sessions.push(Session {
                    tenant: format!("client-{i}"),
                    group: i,
                    system: Arc::new(format!(
                        "Unique task {i}. {}",
                        words(&mut rng, shape.prefix_words / 2)
                    )),
                    turns: vec![words(&mut rng, shape.message_words)],
                    start: Duration::ZERO,
                });
            }
        }
        Kind::HotPrefix => {
            for i in 0..shape.requests {
                let g = if rng.unit() < shape.hot_share || groups.len() == 1 {
                    0
                } else {
                    1 + rng.below(groups.len() - 1)
                };
                sessions.push(Session {
                    tenant: format!("caller-{i}"),
                    group: g,
                    system: groups[g].clone(),
                    turns: vec![words(&mut rng, shape.message_words)],
                    start: Duration::ZERO,
                });
            }
        }
    }
    // Interleave groups so no strategy benefits from a sorted order.
    for i in (1..sessions.len()).rev() {
        let j = rng.below(i + 1);
        sessions.swap(i, j);
    }
    if shape.arrival == Arrival::Staggered && !sessions.is_empty() {
        let n = sessions.len() as u32;
        for (i, s) in sessions.iter_mut().enumerate() {
            s.start = shape.ramp * i as u32 / n;
        }
    }
    sessions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            users: 6,
            turns: 3,
            groups: 2,
            prefix_words: 50,
            message_words: 5,
            questions: 3,
            requests: 10,
            hot_share: 0.8,
            max_tokens: 4,
            arrival: Arrival::Staggered,
            ramp: Duration::from_secs(1),
        }
    }

    #[test]
    fn deterministic_and_shaped() {
        let a = generate(Kind::MultiTurn, &shape(), 7);
        let b = generate(Kind::MultiTurn, &shape(), 7);
        assert_eq!(a.len(), 6);
        assert_eq!(
            a.iter().map(|s| s.turns.clone()).collect::<Vec<_>>(),
            b.iter().map(|s| s.turns.clone()).collect::<Vec<_>>()
        );
        assert!(a.iter().all(|s| s.turns.len() == 3));
        assert_eq!(generate(Kind::DocQa, &shape(), 7).len(), 6);
        let hot = generate(Kind::HotPrefix, &shape(), 7);
        assert!(hot.iter().filter(|s| s.group == 0).count() >= 5);
        let one = generate(Kind::OneShot, &shape(), 7);
        assert_eq!(one.len(), 10);
        assert!(one.iter().map(|s| s.start).max() < Some(Duration::from_secs(1)));
    }
}
