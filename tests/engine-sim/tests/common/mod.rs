//! Test helpers: start the simulator binary on free ports, talk to it over HTTP and ZMQ.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_test_support::{http, ready_line};
use serde_json::Value;
use zeromq::{Socket, SocketRecv, SubSocket};

/// A running simulator process, killed on drop.
pub struct Sim {
    child: Child,
    pub addr: String,
    pub zmq_port: Option<u16>,
    pub replay_port: Option<u16>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free right now (the simulator binds it a moment later; fine on 127.0.0.1 in tests).
pub fn free_port() -> u16 {
    kvroute_test_support::free_port().unwrap()
}

/// Two consecutive free ports (for `--dp-ranks 2`).
pub fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let p = free_port();
        if p < 65_000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no pair of free ports");
}

impl Sim {
    /// Starts the binary with `args` plus `--listen 127.0.0.1:0`; waits (bounded) for its ready line.
    pub fn start(args: &[&str]) -> Sim {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-engine-sim"));
        cmd.args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn kvroute-engine-sim");
        // The ready line is the first line it prints ("listening on <addr> ...").
        let line = ready_line(&mut child, "listening on ", Duration::from_secs(90))
            .unwrap_or_else(|e| panic!("simulator not ready: {e} (its stderr is above)"));
        let addr = line.split_whitespace().next().unwrap().to_string();
        let find = |flag: &str| {
            args.iter()
                .position(|a| *a == flag)
                .map(|i| args[i + 1].parse().unwrap())
        };
        Sim {
            child,
            addr,
            zmq_port: find("--zmq-port"),
            replay_port: find("--replay-port"),
        }
    }

    /// [`Sim::start`] with a ZMQ publisher on a free port, a SUB connected to it and joined
    /// (see [`join`]): the simulator, the SUB and what the join received.
    pub async fn start_subscribed(args: &[&str]) -> (Sim, Sub, Vec<Frame>) {
        let zp = free_port().to_string();
        let sim = Sim::start(&[args, &["--zmq-port", &zp]].concat());
        let mut sub = Sub::connect(sim.zmq_port.unwrap()).await;
        let joined = join(&sim, &mut sub).await;
        (sim, sub, joined)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// `POST /reset_prefix_cache` (its answer is not checked).
    pub async fn reset_prefix_cache(&self) {
        reqwest::Client::new()
            .post(self.url("/reset_prefix_cache"))
            .send()
            .await
            .unwrap();
    }

    /// The cache oracle's answer for a request `body` (`POST /debug/cache/match`).
    pub async fn cache_match(&self, body: &Value) -> Value {
        reqwest::Client::new()
            .post(self.url("/debug/cache/match"))
            .json(body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Kills the process now.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn post(url: &str, body: &Value) -> (reqwest::header::HeaderMap, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .timeout(http::TIMEOUT)
        .send()
        .await
        .unwrap();
    let headers = r.headers().clone();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(status.is_success(), "{url}: {status} {v}");
    (headers, v)
}

pub async fn get_text(url: &str) -> String {
    http::get(url).await.unwrap().1
}

/// One decoded PUB message.
#[derive(Debug, Clone)]
pub struct Frame {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
    pub batch: rmpv::Value,
}

impl Frame {
    /// The batch's events.
    pub fn events(&self) -> Vec<rmpv::Value> {
        self.batch.as_array().unwrap()[1]
            .as_array()
            .unwrap()
            .clone()
    }

    pub fn dp_rank(&self) -> Option<u64> {
        self.batch.as_array().unwrap()[2].as_u64()
    }
}

/// A field of a msgpack map event.
pub fn field<'a>(ev: &'a rmpv::Value, name: &str) -> Option<&'a rmpv::Value> {
    ev.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

pub fn ev_type(ev: &rmpv::Value) -> String {
    field(ev, "type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string()
}

/// Block hashes as u64 bits (SGLang's negative ints included).
pub fn hashes(ev: &rmpv::Value) -> Vec<u64> {
    field(ev, "block_hashes")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().or_else(|| h.as_i64().map(|i| i as u64)).unwrap())
        .collect()
}

pub fn u32s(v: &rmpv::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// A SUB connected to a PUB port.
pub struct Sub {
    sock: SubSocket,
}

impl Sub {
    pub async fn connect(port: u16) -> Sub {
        let mut sock = SubSocket::new();
        sock.connect(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap();
        sock.subscribe("").await.unwrap();
        Sub { sock }
    }

    /// The next message within `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Option<Frame> {
        let msg = tokio::time::timeout(timeout, self.sock.recv())
            .await
            .ok()?
            .ok()?;
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3, "PUB messages have 3 frames");
        let seq = u64::from_be_bytes(frames[1].as_ref().try_into().unwrap());
        let batch = rmpv::decode::read_value(&mut frames[2].as_ref()).unwrap();
        Some(Frame {
            topic: frames[0].clone(),
            seq,
            payload: frames[2].clone(),
            batch,
        })
    }

    /// Messages until one satisfies `pred` (bounded by `deadline`).
    pub async fn until(
        &mut self,
        deadline: Duration,
        mut pred: impl FnMut(&Frame) -> bool,
    ) -> Vec<Frame> {
        let end = Instant::now() + deadline;
        let mut seen = Vec::new();
        while Instant::now() < end {
            if let Some(f) = self
                .recv(end.saturating_duration_since(Instant::now()))
                .await
            {
                let done = pred(&f);
                seen.push(f);
                if done {
                    return seen;
                }
            }
        }
        panic!(
            "no matching ZMQ message within {deadline:?}; saw {} messages",
            seen.len()
        );
    }
}

/// Sends unique probe prompts until the SUB receives something (ZMQ's slow-joiner window:
/// a PUB drops messages until it has seen the subscription). Bounded: 50 tries.
pub async fn join(sim: &Sim, sub: &mut Sub) -> Vec<Frame> {
    for i in 0..50u32 {
        let prompt: Vec<u32> = (0..32).map(|t| 900_000 + i * 100 + t).collect();
        post(
            &sim.url("/v1/completions"),
            &serde_json::json!({"prompt": prompt, "max_tokens": 0}),
        )
        .await;
        if let Some(f) = sub.recv(Duration::from_millis(200)).await {
            let mut got = vec![f];
            // Drain what else the probes produced.
            while let Some(f) = sub.recv(Duration::from_millis(100)).await {
                got.push(f);
            }
            return got;
        }
    }
    panic!("SUB never received a message from the simulator");
}
