//! The latency benchmarks' workload (tests/tests/filter_bench.rs, tests/tests/epp_bench.rs):
//! deterministic prose conversations of a target token count and sequential round trips.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use kvroute_core::chat::ChatTemplate;
use kvroute_core::prompt::{PromptTokens, Request};
use kvroute_core::tokenize::Tokenizer;
use serde_json::{json, Value};

use crate::envoy::Gateway;

/// Deterministic text that tokenizes like prose with a large vocabulary: syllable words, so a
/// new seed gives mostly unseen words (a cold tokenizer cache).
pub struct Prose(pub u64);

impl Prose {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn words(&mut self, n: usize) -> String {
        const SYL: [&str; 24] = [
            "ka", "lo", "mi", "tren", "sor", "vel", "di", "ux", "pra", "ne", "qui", "shal", "or",
            "bet", "fi", "gan", "ho", "jus", "ze", "cri", "mon", "ta", "wel", "yo",
        ];
        let mut s = String::new();
        for i in 0..n {
            let k = 1 + (self.next() % 3) as usize;
            if i > 0 {
                s.push(if self.next() % 12 == 0 { '.' } else { ' ' });
                if s.ends_with('.') {
                    s.push(' ');
                }
            }
            for _ in 0..k {
                s.push_str(SYL[(self.next() % SYL.len() as u64) as usize]);
            }
        }
        s
    }
}

pub struct Counter {
    pub tok: Tokenizer,
    pub tpl: ChatTemplate,
}

impl Counter {
    pub fn tokens(&self, messages: &Value) -> usize {
        let body = json!({"model": "m", "messages": messages}).to_string();
        PromptTokens::from_request(
            &Request::from_json(body.as_bytes()).unwrap(),
            &self.tok,
            Some(&self.tpl),
        )
        .map_or(0, |t| t.len())
    }
}

/// A conversation: system prompt and `turns` alternating turns of 150 words, ending on a user turn.
pub fn conversation(seed: u64, turns: usize) -> Vec<Value> {
    let mut p = Prose(seed | 1);
    let mut msgs = vec![
        json!({"role": "system", "content": format!("You are a helpful assistant. {}", p.words(40))}),
    ];
    for i in 0..turns {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        msgs.push(json!({"role": role, "content": p.words(150)}));
    }
    if turns % 2 == 0 {
        msgs.push(json!({"role": "user", "content": p.words(20)}));
    }
    msgs
}

/// The number of turns that makes a conversation reach `target` tokens (the prose has a stable
/// tokens-per-word ratio, so one calibration per size suffices).
pub fn turns_for(counter: &Counter, target: usize) -> usize {
    (1..200)
        .find(|t| counter.tokens(&Value::Array(conversation(1, *t))) >= target)
        .unwrap_or(200)
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Sequential round trips of `bodies` through `gw`; returns sorted latencies in ms.
pub async fn measure(gw: &Gateway, bodies: &[Vec<u8>]) -> Vec<f64> {
    let mut out = Vec::with_capacity(bodies.len());
    for b in bodies {
        let t0 = Instant::now();
        let r = gw
            .post("/v1/chat/completions", b.clone(), &[])
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
        out.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    out.sort_by(|a, b| a.total_cmp(b));
    out
}
