//! One behavioural suite over every engine's feed (vLLM and SGLang over ZMQ, the TensorRT-LLM
//! drain): the same message histories (in order, duplicate, gap, restart, clear event) delivered
//! through each engine's real message handling into a real fleet, with the blocks held and the
//! clears counted after each history.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use kvroute_core::hash::ExtraKeys;
use rmpv::Value as Mp;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::keyer::Keyer;
use super::{trtllm, zmq, Feed, SeqTracker};
use crate::fleet::{Fleet, Origin};
use crate::index::{EndpointId, Rank};
use crate::metrics::{ClearCause, Metrics};
use crate::settings::Settings;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    Vllm,
    Sglang,
    Trtllm,
}

const ENGINES: [Engine; 3] = [Engine::Vllm, Engine::Sglang, Engine::Trtllm];

/// One message of a history.
#[derive(Clone, Copy, Debug)]
enum Msg {
    /// The engine stored block `n` (16 tokens of its own, a root block).
    Store(u32),
    /// The engine dropped everything (`AllBlocksCleared`; TensorRT-LLM publishes no such event).
    ClearAll,
}

/// One engine's publisher as the service consumes it.
struct Source {
    engine: Engine,
    feed: Feed,
    zmq: zmq::Pub,
    drain: (Keyer, SeqTracker),
}

impl Source {
    fn new(engine: Engine) -> Source {
        let settings = Settings::default();
        let metrics = Arc::new(Metrics::new().unwrap());
        let fleet = Arc::new(Fleet::new(
            metrics,
            settings.clone(),
            CancellationToken::new(),
            None,
            |_, _| {},
        ));
        let name = match engine {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
        };
        let raw = json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp",
                "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16,
                "kvEngineType": name, "kvZmqPort": 5557},
            "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000, "weight": 1}],
        });
        let spec = crate::rules::parse_rule(&raw, &settings).unwrap();
        let rule = fleet.install(spec, Origin::Local).unwrap().rule;
        let feed = Feed {
            fleet,
            rule,
            ep: EndpointId(0),
            rank: Rank(0),
            tap: Default::default(),
        };
        Source {
            engine,
            zmq: zmq::new_pub(&feed),
            drain: (feed.keyer(), SeqTracker::default()),
            feed,
        }
    }

    fn tokens(n: u32) -> Vec<u32> {
        (n * 16..n * 16 + 16).collect()
    }

    /// The key the engine publishes for block `n` (its contract's key, so parity holds).
    fn engine_key(&self, n: u32) -> u64 {
        let c = self.feed.rule.spec.contract().unwrap();
        c.keys(&Self::tokens(n), &ExtraKeys::default()).unwrap()[0].0
    }

    /// Delivers `msg` at sequence (event id) `seq` through the engine's message handling.
    async fn send(&mut self, seq: u64, msg: Msg) {
        if self.engine == Engine::Trtllm {
            let data = match msg {
                Msg::Store(n) => json!({"type": "stored", "parent_hash": null, "blocks": [{
                    "block_hash": 1000 + n,
                    "tokens": Self::tokens(n).iter().map(|t| json!({"token_id": t})).collect::<Vec<Value>>(),
                }]}),
                Msg::ClearAll => panic!("TensorRT-LLM publishes no clear event"),
            };
            let (keyer, seqs) = &mut self.drain;
            trtllm::apply_drain(
                &self.feed,
                keyer,
                seqs,
                &[json!({"event_id": seq, "data": data})],
            );
            return;
        }
        let event = match msg {
            Msg::Store(n) => {
                let key = self.engine_key(n);
                // SGLang publishes keys signed.
                let key = match self.engine {
                    Engine::Sglang => Mp::from(key as i64),
                    _ => Mp::from(key),
                };
                let tokens = Self::tokens(n).into_iter().map(Mp::from).collect();
                Mp::Map(vec![
                    (Mp::from("type"), Mp::from("BlockStored")),
                    (Mp::from("block_hashes"), Mp::Array(vec![key])),
                    (Mp::from("parent_block_hash"), Mp::Nil),
                    (Mp::from("token_ids"), Mp::Array(tokens)),
                    (Mp::from("block_size"), Mp::from(16)),
                    (Mp::from("lora_id"), Mp::Nil),
                    (Mp::from("medium"), Mp::from("GPU")),
                ])
            }
            Msg::ClearAll => Mp::Map(vec![(Mp::from("type"), Mp::from("AllBlocksCleared"))]),
        };
        let mut payload = Vec::new();
        let batch = Mp::Array(vec![Mp::F64(1.0), Mp::Array(vec![event]), Mp::Nil]);
        rmpv::encode::write_value(&mut payload, &batch).unwrap();
        let seq = seq.to_be_bytes();
        zmq::handle(&self.feed, &mut self.zmq, &[b"", &seq, &payload]).await;
    }

    fn blocks(&self) -> u64 {
        self.feed.rule.block_count(EndpointId(0))
    }

    fn clears(&self, cause: ClearCause) -> u64 {
        let engine = self.feed.engine().as_str();
        self.feed.fleet.metrics.clear(engine, cause).get()
    }
}

/// A history, and what the endpoint holds after it: blocks, and clears by cause.
struct Case {
    name: &'static str,
    history: &'static [(u64, Msg)],
    blocks: u64,
    clears: &'static [(ClearCause, u64)],
    /// TensorRT-LLM has no clear event.
    zmq_only: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "in order",
        history: &[(0, Msg::Store(1)), (1, Msg::Store(2)), (2, Msg::Store(3))],
        blocks: 3,
        clears: &[(ClearCause::Gap, 0), (ClearCause::Restart, 0)],
        zmq_only: false,
    },
    Case {
        name: "a repeated message changes nothing",
        history: &[(0, Msg::Store(1)), (1, Msg::Store(2)), (1, Msg::Store(2))],
        blocks: 2,
        clears: &[(ClearCause::Gap, 0), (ClearCause::Restart, 0)],
        zmq_only: false,
    },
    Case {
        name: "a gap clears, then the new message applies",
        history: &[(0, Msg::Store(1)), (1, Msg::Store(2)), (5, Msg::Store(3))],
        blocks: 1,
        clears: &[(ClearCause::Gap, 1), (ClearCause::Restart, 0)],
        zmq_only: false,
    },
    Case {
        name: "a restart (sequence back to 0) clears",
        history: &[
            (0, Msg::Store(1)),
            (1, Msg::Store(2)),
            (2, Msg::Store(3)),
            (0, Msg::Store(4)),
            (1, Msg::Store(5)),
        ],
        blocks: 2,
        clears: &[(ClearCause::Gap, 0), (ClearCause::Restart, 1)],
        zmq_only: false,
    },
    Case {
        name: "a clear event empties the endpoint",
        history: &[
            (0, Msg::Store(1)),
            (1, Msg::Store(2)),
            (2, Msg::ClearAll),
            (3, Msg::Store(3)),
        ],
        blocks: 1,
        clears: &[
            (ClearCause::Event, 1),
            (ClearCause::Gap, 0),
            (ClearCause::Restart, 0),
        ],
        zmq_only: true,
    },
];

#[tokio::test]
async fn every_engine_handles_gaps_restarts_and_clears_alike() {
    let mut failures = Vec::new();
    for case in CASES {
        for engine in ENGINES {
            if case.zmq_only && engine == Engine::Trtllm {
                continue;
            }
            let mut src = Source::new(engine);
            for &(seq, msg) in case.history {
                src.send(seq, msg).await;
            }
            let got_blocks = src.blocks();
            if got_blocks != case.blocks {
                failures.push(format!(
                    "{engine:?}, {}: {got_blocks} blocks, want {}",
                    case.name, case.blocks
                ));
            }
            for &(cause, want) in case.clears {
                let got = src.clears(cause);
                if got != want {
                    failures.push(format!(
                        "{engine:?}, {}: {got} clears by {}, want {want}",
                        case.name,
                        cause.as_str()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
